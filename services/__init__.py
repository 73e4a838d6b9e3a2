"""specmesh services: drafter, datastore, verifier, router, the common package they share,
the embedded single-process mode, the local stack supervisor and the `specmesh` CLI."""
