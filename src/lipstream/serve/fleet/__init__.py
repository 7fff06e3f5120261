"""`lipstream serve --replicas N`: the server as a Ray Serve application, one engine replica per GPU.

front.py: the front deployment (the HTTP API and page, sessions routed to replicas) and the fleet's start.
replica.py: one engine replica, a whole server on its GPU. router.py: Ray Serve's request router by replica.
speech.py and channel.py: live sessions' speech from the front to their replicas (batched; a TCP channel of
its own, Ray calls as the fallback). Only this package imports Ray.
"""
