"""gRPC services (prefill, decode, router) and the `deltamesh` CLI: thin glue around the engine."""
