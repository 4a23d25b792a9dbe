"""Ray orchestration: configuration, launcher, command-line entry point."""
