"""Pure policy: scheduling and verification decisions from plain values, no I/O."""
