"""The model presets, shipped as the package ``duplexrt.configs`` (pyproject maps this folder to
it): ``--config NAME`` reads NAME.toml from here, in a checkout and in an installed wheel alike.
This file only makes the folder a regular package, which an editable install needs to find it."""
