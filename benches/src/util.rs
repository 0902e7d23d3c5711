//! Helpers shared by the subcommands: size parsing and printing, size distributions.

use rand::Rng;

/// clap value parser for sizes: "65536", "64KiB", "1 GiB" (via `kvtide::parse_bytes`).
pub fn parse_size(text: &str) -> Result<u64, String> {
    kvtide::parse_bytes(text).ok_or_else(|| format!("{text:?} is not a size (try 4096, 64KiB, 1GiB)"))
}

/// "64 KiB", "1 MiB", "1.5 GiB", "100 B".
pub fn fmt_bytes(bytes: u64) -> String {
    const UNITS: [(&str, u64); 4] = [("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)];
    for (unit, size) in UNITS {
        if bytes >= size {
            let value = bytes as f64 / size as f64;
            // `size` is a power of two.
            return if bytes & (size - 1) == 0 {
                format!("{} {unit}", bytes / size)
            } else {
                format!("{value:.1} {unit}")
            };
        }
    }
    format!("{bytes} B")
}

/// How object sizes are drawn.
#[derive(Clone, Copy, Debug)]
pub enum SizeDist {
    /// Every object has this size.
    Fixed(u64),
    /// `exp(uniform(ln min, ln max))`: as many objects in 4-8 KiB as in 2-4 MiB.
    LogUniform { min: u64, max: u64 },
}

impl SizeDist {
    /// Draws one size.
    pub fn sample(&self, rng: &mut impl Rng) -> u64 {
        match *self {
            SizeDist::Fixed(size) => size,
            SizeDist::LogUniform { min, max } => {
                if max <= min {
                    return min;
                }
                let (lo, hi) = ((min as f64).ln(), (max as f64).ln());
                (rng.random_range(lo..hi).exp() as u64).clamp(min, max)
            }
        }
    }

    /// Smallest size this distribution yields.
    pub fn min(&self) -> u64 {
        match *self {
            SizeDist::Fixed(size) => size,
            SizeDist::LogUniform { min, .. } => min,
        }
    }

    /// Short description for table rows.
    pub fn label(&self) -> String {
        match *self {
            SizeDist::Fixed(size) => format!("fixed {}", fmt_bytes(size)),
            SizeDist::LogUniform { min, max } => format!("log-uniform {}..{}", fmt_bytes(min), fmt_bytes(max)),
        }
    }
}

/// Escapes a string for a JSON line.
pub fn json_str(text: &str) -> String {
    let mut out = String::with_capacity(text.len() + 2);
    out.push('"');
    for c in text.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
    out
}

/// A stamped value: any misplaced byte shows.
pub fn stamped(len: u64, seed: u64) -> Vec<u8> {
    let mut state = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// A progress bar on stderr for a workload of `steps` steps (hidden when stderr is not a
/// terminal, so logs and CI output stay clean).
pub fn steps(steps: u64, what: &str) -> indicatif::ProgressBar {
    let bar = indicatif::ProgressBar::with_draw_target(Some(steps), indicatif::ProgressDrawTarget::stderr());
    if let Ok(style) = indicatif::ProgressStyle::with_template("{prefix} [{bar:30}] {pos}/{len} {msg} ({elapsed})") {
        bar.set_style(style.progress_chars("=> "));
    }
    bar.set_prefix(what.to_string());
    bar
}

/// Page p (object-major) goes to pool slot `slots[p]`: a fixed shuffle of `pages` slots.
pub(crate) fn shuffled_slots(pages: u64, seed: u64) -> Vec<u64> {
    let mut slots: Vec<u64> = (0..pages).collect();
    let mut state = seed | 1;
    for i in (1..slots.len()).rev() {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        slots.swap(i, (state % (i as u64 + 1)) as usize);
    }
    slots
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("64KiB"), Ok(65536));
        assert!(parse_size("lots").is_err());
        assert_eq!(fmt_bytes(65536), "64 KiB");
        assert_eq!(fmt_bytes(1 << 30), "1 GiB");
        assert_eq!(fmt_bytes(100), "100 B");
        let mut rng = rand::rngs::SmallRng::seed_from_u64(1);
        let d = SizeDist::LogUniform { min: 4096, max: 4 << 20 };
        for _ in 0..1000 {
            let s = d.sample(&mut rng);
            assert!((4096..=4 << 20).contains(&s));
        }
        assert_eq!(json_str("a\"b"), "\"a\\\"b\"");
    }
}
