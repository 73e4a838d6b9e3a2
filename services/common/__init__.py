"""What the service roles share: token tree, sampling, configuration, model loading, the LM runner,
the pool client, telemetry and gRPC plumbing. Roles import this package, never each other."""
