"""PyTorch memory: the stream-ordered allocator switch (:mod:`.allocator`, which imports no torch
at import time), graph pools as expandable segments (:mod:`.pool_segments`), optimizer steps
borrowing the graphs' pool (:mod:`.pool_lending`), graph outputs handed out and watched per
storage (:mod:`.handout`), and the runtime's memory capabilities (:mod:`.capabilities`)."""
