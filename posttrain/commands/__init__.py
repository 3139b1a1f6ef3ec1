"""CLI commands: one module each, with `register(subparsers)`; `posttrain.cli` finds them all."""
