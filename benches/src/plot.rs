//! SVG charts of benchmark results (`--plot FILE.svg`), drawn with plotters.
//!
//! Owns two charts: latency CDFs (one line per system, log-scale time) and a restore's
//! sub-batch timeline (per sub-batch: loading, waiting for the transfer stage, transferring,
//! held until released). Never measures anything: it draws what the benchmarks recorded.

use std::path::Path;

use kvtide::SubBatchTrace;
use plotters::prelude::*;

use crate::hist::Histogram;

const COLORS: [RGBColor; 6] = [
    RGBColor(31, 119, 180),
    RGBColor(255, 127, 14),
    RGBColor(44, 160, 44),
    RGBColor(214, 39, 40),
    RGBColor(148, 103, 189),
    RGBColor(140, 86, 75),
];

fn err(e: impl std::fmt::Display) -> String {
    format!("plot: {e}")
}

/// Draws the series' legend in the lower right corner and writes the file.
fn legend_and_save<'a, CT: plotters::coord::CoordTranslate>(
    chart: &mut ChartContext<'a, SVGBackend<'a>, CT>,
    root: &DrawingArea<SVGBackend<'a>, plotters::coord::Shift>,
) -> Result<(), String> {
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.9))
        .border_style(BLACK)
        .draw()
        .map_err(err)?;
    root.present().map_err(err)
}

/// Latency CDFs of `series` (label, histogram of nanoseconds) into `path`.
pub fn latency_cdfs(path: &Path, title: &str, series: &[(String, &Histogram)]) -> Result<(), String> {
    let curves: Vec<(String, Vec<(f64, f64)>)> =
        series.iter().filter(|(_, h)| h.count() > 0).map(|(l, h)| (l.clone(), h.cdf_us())).collect();
    let (lo, hi) = curves
        .iter()
        .flat_map(|(_, c)| c.iter().map(|p| p.0))
        .fold((f64::MAX, 0f64), |(lo, hi), x| (lo.min(x), hi.max(x)));
    if curves.is_empty() || hi <= 0.0 {
        return Err("plot: no latencies recorded".into());
    }
    let (lo, hi) = ((lo * 0.8).max(0.01), hi * 1.25);
    let root = SVGBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(50)
        .build_cartesian_2d((lo..hi).log_scale(), 0f64..1f64)
        .map_err(err)?;
    chart.configure_mesh().x_desc("latency (µs, log scale)").y_desc("fraction of requests").draw().map_err(err)?;
    for (i, (label, curve)) in curves.iter().enumerate() {
        let color = COLORS[i % COLORS.len()];
        // A step function: each bucket's fraction holds until the next bucket.
        let mut points = Vec::with_capacity(curve.len() * 2 + 1);
        let mut last = 0.0;
        for &(x, y) in curve {
            points.push((x, last));
            points.push((x, y));
            last = y;
        }
        chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(err)?
            .label(label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)));
    }
    legend_and_save(&mut chart, &root)
}

/// One restore's sub-batches on a time line into `path`.
pub fn sub_batch_timeline(path: &Path, title: &str, traces: &[SubBatchTrace]) -> Result<(), String> {
    if traces.is_empty() {
        return Err("plot: no sub-batches traced".into());
    }
    let end_ms = traces.iter().map(|t| t.release_us.max(t.transfer_end_us)).max().unwrap_or(1) as f64 / 1e3;
    let rows = traces.len();
    let height = (120 + rows * 14).clamp(300, 1600) as u32;
    let root = SVGBackend::new(path, (1000, height)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 18))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..end_ms * 1.02, 0f64..rows as f64)
        .map_err(err)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .x_desc("time since the request started (ms)")
        .y_desc("sub-batch (shard)")
        .y_label_formatter(&|y| {
            let i = *y as usize;
            traces.get(i).map_or(String::new(), |t| format!("{} ({})", t.index, t.shard))
        })
        .draw()
        .map_err(err)?;
    let phases: [(&str, RGBColor); 4] = [
        ("load", COLORS[0]),
        ("waiting for the transfer stage", RGBColor(200, 200, 200)),
        ("transfer", COLORS[1]),
        ("held until released", RGBColor(230, 230, 230)),
    ];
    for (p, (label, color)) in phases.iter().enumerate() {
        let bars = traces.iter().enumerate().map(|(row, t)| {
            let (from, to) = match p {
                0 => (t.load_start_us, t.ready_us),
                1 => (t.ready_us, t.transfer_start_us),
                2 => (t.transfer_start_us, t.transfer_end_us),
                _ => (t.transfer_end_us, t.release_us),
            };
            let y = row as f64;
            Rectangle::new([(from as f64 / 1e3, y + 0.15), (to.max(from) as f64 / 1e3, y + 0.85)], color.filled())
        });
        let color = *color;
        chart
            .draw_series(bars)
            .map_err(err)?
            .label(*label)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 16, y + 5)], color.filled()));
    }
    legend_and_save(&mut chart, &root)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn both_charts_write_svg_with_their_series() {
        let dir = std::env::temp_dir().join(format!("kvtide-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("dir");
        let (mut a, mut b) = (Histogram::default(), Histogram::default());
        for i in 1..1000u64 {
            a.record(i * 1000);
            b.record(i * 3000);
        }
        let cdf = dir.join("cdf.svg");
        latency_cdfs(&cdf, "cdf", &[("fast".into(), &a), ("slow".into(), &b)]).expect("cdf");
        let text = std::fs::read_to_string(&cdf).expect("read");
        assert!(text.starts_with("<svg") && text.contains("fast") && text.contains("slow"));
        assert!(latency_cdfs(&cdf, "empty", &[("none".into(), &Histogram::default())]).is_err());
        let trace = |index: usize, t0: u64| SubBatchTrace {
            index,
            shard: index % 2,
            keys: 4,
            staging_bytes: 4 << 20,
            load_start_us: t0,
            ready_us: t0 + 500,
            transfer_start_us: t0 + 600,
            transfer_end_us: t0 + 900,
            release_us: t0 + 950,
            state: kvtide::SubBatchState::Released,
            path: Vec::new(),
            failed_keys: 0,
        };
        let timeline = dir.join("timeline.svg");
        sub_batch_timeline(&timeline, "timeline", &[trace(0, 0), trace(1, 400)]).expect("timeline");
        let text = std::fs::read_to_string(&timeline).expect("read");
        assert!(text.starts_with("<svg") && text.contains("transfer") && text.matches("<rect").count() >= 8);
        assert!(sub_batch_timeline(&timeline, "none", &[]).is_err());
        let _ = std::fs::remove_dir_all(&dir);
    }
}
