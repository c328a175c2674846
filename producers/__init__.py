"""The writer/reader side: `SessionStore`, its ports, and the in-memory and Kafka event logs."""
