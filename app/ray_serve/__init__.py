"""mmserve on Ray Serve (docs/architecture.md, "Replicas on Ray Serve"): an ingress deployment that takes
the OpenAI requests and a replica deployment that owns one whole mmserve instance each, with a request
router that sends repeated media to the replica that holds it. Needs the ``ray`` extra; nothing outside
this package imports it except ``mmserve ray serve``."""
