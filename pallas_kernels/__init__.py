"""Pallas attention kernels; each kernel file holds its plain-jnp ``*_reference`` twin."""
