"""Preset U-Net configs, shipped inside the package as sdkit._configs (see pyproject.toml)."""
