"""Long-lived HTTP answers: SSE streams, held responses and the one chunk-per-turn pacer."""
