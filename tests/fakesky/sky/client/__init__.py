"""The fake's stand-in for `sky.client` (only what sky_helper/sky_sdk.py uses)."""
