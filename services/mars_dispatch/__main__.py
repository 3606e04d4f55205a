from mars_dispatch.service import main

main()
