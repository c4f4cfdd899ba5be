"""sdkit: look inside the cross-attention of Stable Diffusion 1.x U-Nets."""

__version__ = "0.1.0"
