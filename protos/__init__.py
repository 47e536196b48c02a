"""gRPC contracts between speclane services; generated modules sit beside each .proto."""
