"""Image inputs (docs/images.md): decoded, preprocessed and hashed in the front process
(`images`, `processing`), their pixels handed to the scheduler ranks through shared memory
(`shm`) with only a small `ImageRef` in the broadcast, encoded once per content hash
(`encoder_cache`), and placed in the batch by `spans`."""
