"""Moving tensors between workers and state servers. The only package that imports the
generated gRPC code; everything outside it sees internal dataclasses and tensors."""
