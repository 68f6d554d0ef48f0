//! Ingest tests over a real tonic server on 127.0.0.1.
