from mars_judge.service import main

main()
