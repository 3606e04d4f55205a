from mars_ingress.service import main

main()
