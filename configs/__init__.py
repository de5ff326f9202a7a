"""Per-architecture kernel tables (JSON), shipped as package data of
``conv_patch.configs``; see README.md beside this file."""
