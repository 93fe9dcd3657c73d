"""mmpipe's Hydra configs, shipped as package data (a package so Hydra finds them as pkg://mmpipe.conf)."""
