"""Preset U-Net configs (diffusers config.json files), shipped as package data: sdkit audit sd15 etc."""
