"""Generated protobuf and gRPC code for bigfleet.v1alpha1 (run `make proto`; never edit by hand)."""
