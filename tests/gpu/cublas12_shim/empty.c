/* empty: faiss-gpu-cu12 lists libcublasLt.so.12 as needed but calls nothing in it */
