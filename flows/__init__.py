"""Prefect flows and the `forgeweave` CLI. The flows are thin runbooks over forge's stage functions."""
