from mars_router.service import main

main()
