"""kvgate as the endpoint picker (EPP) of an Envoy-based gateway: Envoy holds the
connections and relays the bytes, and asks kvgate over gRPC ext_proc where each request
goes (the Gateway API Inference Extension's endpoint picker protocol). See README.md here."""
