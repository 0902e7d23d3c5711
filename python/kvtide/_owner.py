"""The ``kvtide-owner`` console command of the wheel. Owns finding the owner binary that the
wheel carries (``kvtide/bin/kvtide-owner``, built by ``python/build_wheel.sh``) and replacing
this Python process with it. Never parses the owner's arguments: they go to the owner as given,
so its ``--help``, its signals and its exit codes are the owner's own."""

import os
import sys
from pathlib import Path

BUNDLED = Path(__file__).resolve().parent / "bin" / "kvtide-owner"


def bundled_binary():
    """The owner binary inside this installed package, or None (a checkout, where
    ``cargo build -p kvtide-remote --bin kvtide-owner`` builds it under ``target/``)."""
    return str(BUNDLED) if BUNDLED.is_file() else None


def main():
    binary = bundled_binary()
    if binary is None:
        sys.stderr.write(
            f"kvtide-owner: this kvtide package has no bundled owner binary ({BUNDLED} is missing); install the "
            "wheel that python/build_wheel.sh builds, or run the owner cargo builds "
            "(cargo build --release -p kvtide-remote --bin kvtide-owner)\n"
        )
        return 2
    if not os.access(binary, os.X_OK):
        sys.stderr.write(f"kvtide-owner: {binary} is not executable (the wheel was unpacked without its file modes)\n")
        return 2
    sys.stdout.flush()
    sys.stderr.flush()
    # Replaces this process: the owner gets this process id, its signals and its exit code.
    os.execv(binary, [binary, *sys.argv[1:]])
    return 0  # not reached


if __name__ == "__main__":
    sys.exit(main())
