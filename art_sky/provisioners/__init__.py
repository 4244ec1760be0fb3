"""Provisioners obtain a machine for the cluster server where the user does not name one: SkyPilot (sky: the SDK
calls; sky_task: the task YAMLs). An SSH host is named by the user, this machine is here; after that every kind
shares the same lifecycle, tunnel and HTTP client (art_sky.remote, art_sky.backends).
"""
