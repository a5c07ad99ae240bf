"""From documents to chunks and back: corpus reading, token chunking, BM25 (pyserini, JVM bootstrap), dense (faiss), neighbours."""
