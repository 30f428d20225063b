"""The fake's stand-in for `sky.client` (only what remote/sky_sdk.py uses)."""
