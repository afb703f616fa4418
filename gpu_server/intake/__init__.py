"""The way in: the gRPC service and the shared-folder reader (I/O only), the one RecordStream every transport feeds,
and the admission that classifies each record once (docs/design.md §6.2)."""
