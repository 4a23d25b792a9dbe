"""What every process imports: the model's layout, the AdamW math, the update call, the
wire's dtypes, errors, and the rules for files written to disk. Nothing here imports Ray,
gRPC or torch.distributed, so it all tests without a cluster."""
