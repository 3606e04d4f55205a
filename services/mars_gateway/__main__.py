from mars_gateway.server import main

main()
