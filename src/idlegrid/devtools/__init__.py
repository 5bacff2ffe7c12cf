"""Development aids: a whole grid in local processes, the demo, and fault points for tests."""
