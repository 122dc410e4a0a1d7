"""How HTTP reaches a replica: Serve's proxy or HAProxy, the prefix-aware router, the proxy's errors."""
