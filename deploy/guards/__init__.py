"""In front of the request path: API keys, body and request limits, admission, draining on shutdown."""
