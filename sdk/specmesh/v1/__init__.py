"""Generated protobuf and gRPC stubs of the specmesh.v1 API (built from protos/ at install time)."""
