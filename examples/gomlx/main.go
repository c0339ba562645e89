package main

import (
	"fmt"
	"os"
)

func main() {
	c := defaultConfig()
	ref, err := runReference(c)
	if err != nil {
		fmt.Println(err)
		os.Exit(1)
	}
	fmt.Println(ref.loss)
	for _, spec := range []runSpec{{2, false}, {3, false}, {2, true}, {3, true}} {
		res, err := trainZero(c, spec)
		if err != nil {
			fmt.Println(err)
			os.Exit(1)
		}
		fmt.Println(spec, res.loss)
	}
}
