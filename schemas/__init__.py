"""The ground layer: event vocabulary, the error hierarchy and the Avro wire format."""
