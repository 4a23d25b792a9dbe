"""Generated gRPC/protobuf code of the state-server API, version 1.

Regenerate with ``python proto/generate.py``; tests/test_proto_current.py fails when the
checked-in files differ from what the pinned grpcio-tools produces.
"""
