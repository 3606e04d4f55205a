from mars_memory.service import main

main()
