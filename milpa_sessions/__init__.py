"""The application layer: settings wiring, the CLI and the demo."""
