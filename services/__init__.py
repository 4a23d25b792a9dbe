"""Long-running parts of cargohold: workers, state servers, tiers, transport, metrics."""
