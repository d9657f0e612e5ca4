"""Shipped controller policies (NAME.pt + NAME.json), installed as package data ``dynamix_hvd.policies``."""
