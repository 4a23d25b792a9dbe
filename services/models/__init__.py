"""Models cargohold can train out of the box."""
