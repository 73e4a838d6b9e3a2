"""Gateway: the public API of a specmesh deployment (gRPC `specmesh.v1.Gateway`). Validates
requests, applies chat templates, tokenizes, and relays to the router."""
