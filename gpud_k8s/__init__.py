"""gpud-k8s: gpud's Kubernetes node agent, a DRA driver (``gpu.gpud.io``) and a device-plugin fallback.

It runs in its own process beside gpud and speaks to it as an admin client (``gpud_client``); gRPC
and the Kubernetes client stay out of the daemon. Installed with the ``k8s`` extra.
"""
