"""The fake's stand-in for `sky.client` (only what skypilot/helper/sky_sdk.py uses)."""
