"""Host store, streaming schedule, chunked loss and host optimizer."""
