"""Retrieval backends behind small interfaces: sentence embeddings, FAISS dense indexes, fusion, and the
hybrid chunk/session memory used by the memory service and the RealMem benchmark."""
